"""The measuring parts of ``bench --real`` that run without a real server: the streaming
client's TTFT and token ids (against a loopback SSE server that streams like vLLM's
OpenAI server), and the ``vllm bench serve`` command line, parsed by vLLM's own parser."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ascendstore_vllm.testing.openai_server import VllmServer

#: the second token comes this long after the first: a TTFT dated at any later token
#: (or at the end of the request) is at least this late.
SECOND_TOKEN_DELAY_S = 1.5


class _Streamer(BaseHTTPRequestHandler):
    """/v1/completions streamed as vLLM's server (uvicorn) does: HTTP/1.1 chunked, one
    server-sent event per token, usage last."""

    protocol_version = "HTTP/1.1"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, tok in enumerate((17, 4, 99)):
            lp = None
            if body.get("logprobs"):
                lp = {"tokens": [f"token_id:{tok}"], "token_logprobs": [-0.5],
                      "top_logprobs": [{f"token_id:{tok}": -0.5}]}
            chunk = {"choices": [{"index": 0, "text": f"t{tok}", "logprobs": lp,
                                  "finish_reason": "length" if i == 2 else None}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0:
                time.sleep(SECOND_TOKEN_DELAY_S)
        usage = {"choices": [], "usage": {"prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 64}}}
        self._chunk(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self._chunk(b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_server(tmp_path: Path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    s = VllmServer("tiny", log_path=tmp_path / "unused.log")
    s.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield s
    httpd.shutdown()


@pytest.mark.parametrize("logprobs", [0, 1])
def test_ttft_is_the_first_token_not_the_whole_request(fake_server, logprobs: int) -> None:
    c = fake_server.complete("hello", 3, logprobs=logprobs)
    assert c.total_s >= SECOND_TOKEN_DELAY_S
    assert c.ttft_s < SECOND_TOKEN_DELAY_S, (c.ttft_s, c.total_s)
    assert c.text == "t17t4t99" and (c.prompt_tokens, c.cached_tokens) == (70, 64)
    # token ids travel in logprobs only: without them there is nothing to compare outputs by
    assert c.token_ids == ([17, 4, 99] if logprobs else [])


def test_vllm_bench_serve_command_line_is_vllms_own(tmp_path: Path) -> None:
    """The arguments bench --real gives vLLM's client parse with vLLM's parser (its
    ``vllm bench serve``), as a custom dataset read in order."""
    pytest.importorskip("vllm.benchmarks.serve")
    from ascendstore_vllm.bench import vllm_serve

    data = vllm_serve.write_dataset(tmp_path / "docs.jsonl", ["a b c", 'quote " and\nnewline'])
    assert [json.loads(x)["prompt"] for x in data.read_text().splitlines()] == ["a b c", 'quote " and\nnewline']
    argv = vllm_serve.argv_for(url="http://127.0.0.1:1", model="m", dataset=data, num_prompts=2, max_tokens=4,
                               result_dir=tmp_path, result_name="r.json", label="pool")
    args = vllm_serve.parser().parse_args(argv)
    assert (args.dataset_name, args.dataset_path, args.num_prompts) == ("custom", str(data), 2)
    assert (args.max_concurrency, args.custom_output_len, args.ready_check_timeout_sec) == (1, 4, 0)
    assert args.disable_shuffle and args.skip_chat_template and args.save_detailed and args.ignore_eos
