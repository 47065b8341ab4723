"""``lightning-par-checkpoint``: convert and inspect checkpoints of any layout.

    lightning-par-checkpoint convert CKPT_DIR one.ckpt                           # DCP dir -> plain Lightning file
    lightning-par-checkpoint convert one.ckpt model.safetensors --strip-prefix net.
    lightning-par-checkpoint convert one.ckpt CKPT_DIR                           # file -> DCP directory
    lightning-par-checkpoint inspect CKPT_DIR
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from lightning_par.cli_errors import ArgumentParser, UsageError, run_cli

PROG = "lightning-par-checkpoint"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert SRC to DST; DST's suffix picks the form (.ckpt, .safetensors, "
                                          "anything else: a DCP directory)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--strip-prefix", default="", help="drop this prefix from the names (safetensors for a "
                                                         "Hugging Face model: --strip-prefix net.)")
    conv.add_argument("--weights-only", action="store_true", help="leave out optimizer states and schedulers")
    ins = sub.add_parser("inspect", help="print the layout SRC was saved under, its step and its tensors")
    ins.add_argument("src")
    args = parser.parse_args(argv)

    def body() -> None:
        from lightning_par.checkpoint.convert import convert, describe

        if args.command == "convert":
            form = convert(args.src, args.dst, strip_prefix=args.strip_prefix, weights_only=args.weights_only)
            print(f"wrote {args.dst} ({form})")
        else:
            for line in describe(args.src).splitlines():
                print(line)
            sys.stdout.flush()  # a closed pipe (`| head`) raises here, inside run_cli, not at the exit

    # the library's errors name the path, the value and the fix; OSError covers a full disk or a denied write
    return run_cli(PROG, body, argv, user_errors=(UsageError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
