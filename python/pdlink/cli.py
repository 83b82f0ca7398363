"""The ``pdlink`` command: ``pdlink demo`` and ``pdlink version``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pdlink", description="KV-cache transfer between prefill and decode instances")
    parser.add_argument("-v", "--verbose", action="store_true", help="log pdlink's Python layer at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two processes: move KV, verify, switch roles, move it back, print GB/s")
    demo.add_argument("--size-mib", type=int, default=64, help="bytes moved per pull (default 64 MiB)")
    demo.add_argument("--block-kib", type=int, default=256, help="KV block size (default 256 KiB)")
    demo.add_argument("--tensors", type=int, default=8, help="tensors in the cache, K and V of each layer (default 8)")
    demo.add_argument("--repeat", type=int, default=5, help="pulls per direction; the median is reported (default 5)")
    sub.add_parser("version", help="print versions")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.command == "version":
        from . import __version__, _core

        print(f"pdlink {__version__} (wire protocol {_core.PROTOCOL_VERSION}, backends: cpu)")
        return 0
    for name in ("size_mib", "block_kib", "tensors", "repeat"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    from .demo import run

    return run(size_mib=args.size_mib, block_kib=args.block_kib, num_tensors=args.tensors, repeat=args.repeat)


if __name__ == "__main__":
    sys.exit(main())
