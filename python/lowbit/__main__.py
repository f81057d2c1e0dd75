"""lowbit command line.

    python -m lowbit inspect FILE.gguf   metadata and tensor table of a GGUF file
"""
import argparse
import sys

from .gguf_file import GGUFError, GGUFFile, load_gguf

MAX_LIST_ITEMS = 8  # longer arrays (token lists, merges) print as "[N items]"
MAX_VALUE_CHARS = 100  # long strings (chat templates) are cut to keep one line per key


def format_value(value) -> str:
    if isinstance(value, list) and len(value) > MAX_LIST_ITEMS:
        return f"[{len(value)} items]"
    text = repr(value)  # repr escapes newlines, so every key stays on one line
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}... ({len(text)} chars)"
    return text


def format_shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def print_inspect(f: GGUFFile) -> None:
    print(f"{f.path}: GGUF v{f.version}, alignment {f.alignment}, "
          f"{len(f.metadata)} metadata keys, {len(f.tensors)} tensors")
    print()
    for key, value in f.metadata.items():
        print(f"{key} = {format_value(value)}")
    print()
    header = ("name", "type", "shape", "bytes", "bpw")
    rows = [(t.name, t.type_name, format_shape(t.shape), str(t.nbytes), f"{t.bits_per_weight:.2f}")
            for t in f.tensors.values()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        # name and type left-aligned, numbers right-aligned
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    total_bytes = sum(t.nbytes for t in f.tensors.values())
    total_elements = sum(t.n_elements for t in f.tensors.values())
    average_bpw = 8 * total_bytes / total_elements if total_elements else 0.0
    print(f"total: {len(f.tensors)} tensors, {total_bytes} bytes, {average_bpw:.2f} bits per weight")


def cmd_inspect(args) -> None:
    with load_gguf(args.file) as f:
        print_inspect(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit", description="lowbit tools")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print a GGUF file's metadata and tensor table")
    inspect.add_argument("file", help="path to a .gguf file")
    inspect.set_defaults(run=cmd_inspect)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
