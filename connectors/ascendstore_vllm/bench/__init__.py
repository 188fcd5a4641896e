"""The vLLM-driving half of ``ascendstore bench`` (the vLLM-free half is
``ascendstore.bench``). Importing this package does not import vLLM."""
