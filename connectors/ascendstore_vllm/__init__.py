"""AscendStore's vLLM connector (the only AscendStore package that imports vLLM).

Importing this package does not import vLLM; ``ascendstore_vllm.connector``
does. Registration happens through the ``vllm.general_plugins`` entry point
(``ascendstore_vllm.plugin:register``).
"""

CONNECTOR_NAME = "AscendStoreConnector"
CONNECTOR_ALIAS = "AscendStorePoolConnector"
