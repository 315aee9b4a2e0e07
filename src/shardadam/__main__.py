"""Command line: ``python -m shardadam info`` (more commands join as they land)."""

import argparse
import sys


def _info(_args):
    import torch

    import shardadam

    print(f"shardadam {shardadam.__version__}  (torch {torch.__version__})")
    try:
        from shardadam import _C
    except ImportError as error:
        print(f"C++ core:       not built ({error})")
        print("backends:       torch")
        return 0
    info = _C.info()
    print(f"C++ core:       {info['version']}")
    print(f"SIMD target:    {info['simd_target']} (supported: {info['supported_targets']})")
    print(f"threads:        {torch.get_num_threads()} used by step() "
          f"({info['default_threads']} hardware threads)")
    backends = ["cpu (C++)"] + (["cuda (C++)"] if info["cuda"] else []) + ["torch (other devices)"]
    print(f"backends:       {', '.join(backends)}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m shardadam",
        description="shardadam: fused Adam/AdamW for sharded training with a C++ core.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, SIMD target, threads and built backends") \
        .set_defaults(run=_info)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
