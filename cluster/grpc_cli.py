"""`kvserve complete`: stream a completion from a running kvserve over gRPC to stdout.

    kvserve complete "Once upon a time"                       # 127.0.0.1:9000
    kvserve complete --grpc host:9000 --max-tokens 64 --temperature 0 "Hello"
    kvserve complete --chat "What is the capital of France?"
    echo "Hello" | kvserve complete -                          # the prompt from stdin

Text is written as it arrives; `--usage` adds token counts and time to first token on
stderr. Ctrl-C cancels the call (the server aborts the request). Exit status: 0, 1 on a
server error (its gRPC status and message on stderr), 2 on bad arguments, 130 on Ctrl-C.

Registered in cluster/cli.py's SUBCOMMANDS as "complete": "cluster.grpc_cli:register";
also runs standalone: `python -m cluster.grpc_cli complete ...`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from cluster.listen_config import GRPCSection, HTTPSection

# Where `kvserve serve` listens by default (the config schema's defaults).
DEFAULT_TARGET = f"{HTTPSection().host}:{GRPCSection().port}"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "complete",
        help="stream a completion from a running kvserve (gRPC) to stdout",
        description="Stream a completion from a running kvserve over gRPC.",
    )
    parser.add_argument("prompt", help="the prompt text ('-': read it from stdin)")
    parser.add_argument("--grpc", metavar="HOST:PORT", default=DEFAULT_TARGET, help=f"the gRPC address (default {DEFAULT_TARGET})")
    parser.add_argument("--model", default="", help="the served model name (default: the server's)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    parser.add_argument("--system", help="with --chat: a system message first")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, help="0 is greedy (default: the server's, 1)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--usage", action="store_true", help="print token counts and latency on stderr")
    parser.add_argument("--application", help="the Serve application (needed when the cluster runs several)")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="sent as a bearer token (default $KVSERVE_API_KEY)")
    parser.add_argument("--timeout", type=float, help="deadline of the call in seconds")
    parser.set_defaults(func=run_complete)


def run_complete(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    from router.frontend.grpc_api.client import KVServeClient, KVServeError

    out = stdout or sys.stdout
    err = stderr or sys.stderr
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    if args.chat:
        messages = ([("system", args.system)] if args.system else []) + [("user", prompt)]
        inputs: dict[str, Any] = {"messages": messages}
    else:
        inputs = {"prompt": prompt}
    with KVServeClient(args.grpc, args.api_key, application=args.application, timeout=args.timeout) as client:
        stream = client.generate_stream(model=args.model, **inputs, **options)
        last = None
        wrote = False
        try:
            for message in stream:
                if message.text:
                    out.write(message.text)
                    out.flush()
                    wrote = True
                last = message
        except KVServeError as e:
            print(f"{chr(10) if wrote else ''}kvserve: {e.code.name}: {e.details}", file=err)
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            print(f"{chr(10) if wrote else ''}kvserve: cancelled", file=err)
            return 130
        out.write("\n")
        out.flush()
        if args.usage and last is not None:
            u, t = last.usage, last.timing
            print(
                f"kvserve: {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens "
                f"({u.cached_prompt_tokens} cached), first token {t.time_to_first_token_s * 1000:.0f} ms, "
                f"total {t.elapsed_s * 1000:.0f} ms, finish {_finish_name(last.finish_reason)}",
                file=err,
            )
    return 0


def _finish_name(value: int) -> str:
    from protos.kvserve.v1 import kvserve_pb2 as pb

    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
