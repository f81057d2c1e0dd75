"""lowbit command line.

    python -m lowbit inspect FILE.gguf              metadata and tensor table of a GGUF file
    python -m lowbit inspect PATH                   quantization config and module table of a GPTQ
                                                    checkpoint (directory or .safetensors file)
    python -m lowbit convert-gptq SRC DST --to v2   rewrite a GPTQ checkpoint's zeros as v2 (or v1)
    python -m lowbit generate PATH PROMPT           continuation by a GGUF file's model (an architecture
                                                    of lowbit.gguf.arch.ARCHITECTURES) or a GPTQ
                                                    directory's, running their own quantized weights:
                                                    greedy, or sampled with --temperature (--top-k,
                                                    --top-p, --seed); --tokens, --threads, --chat,
                                                    --no-repack, --compile, --check-tensors,
                                                    --int8-activations, --float-tables (`--help`
                                                    says what each does)
"""
import argparse
import contextlib
import os
import sys
import time
import warnings

import torch

from ._bounded import BoundedError, run_bounded
from ._checks import cut
from .gguf.arch import ARCHITECTURES
from .gguf.file import GGUFFile, is_gguf_path, load_gguf
from .gptq.checkpoint import load_gptq
from .gptq.convert import convert_checkpoint
from .gptq.linear import GPTQLinear
from .threads import MAX_POOL_THREADS

GPTQ_FORMATS = {"v1": "gptq", "v2": "gptq_v2"}  # --to choices -> checkpoint_format

MAX_LIST_ITEMS = 8  # longer arrays (token lists, merges) print as "[N items]"
MAX_VALUE_CHARS = 100  # long strings (chat templates) are cut to keep one line per key
MAX_NAME_CHARS = 100  # longer keys and names are cut too (llama.cpp's tensor names stay below 64)
MAX_REASON_CHARS = 300  # a chat template's error message is cut to this
# Files a checkpoint directory's tokenizer is read from (AutoTokenizer needs one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
MIN_TEMPERATURE = 1e-6  # logits of a few thousand over it stay far inside float32's range
MAX_CHARS_PER_TOKEN = 64  # a chat prompt longer than this per context position is refused untokenized
TEMPLATE_SECONDS = 10  # a chat template renders in milliseconds: one looping for longer is refused
TEMPLATE_BYTES = 1 << 30  # the memory a chat template's rendering may take
TEMPLATE_CHARS = 1 << 20  # the text a chat template may add to the prompt
# Tokens the generate stream holds back while their text ends inside a character: a
# UTF-8 character has at most 4 bytes, and every token that is text carries one at least.
MAX_HELD_TOKENS = 8


class _Items:
    """What a long array prints as, at any depth: "[N items]"."""

    def __init__(self, n: int):
        self.n = n

    def __repr__(self) -> str:
        return f"[{self.n} items]"


def _shortened(value):
    """`value` with every array longer than MAX_LIST_ITEMS, nested ones too,
    as its length: repr of a short array of long ones would be built whole
    (hundreds of MB for a hostile file) only to be cut."""
    if isinstance(value, list):
        return _Items(len(value)) if len(value) > MAX_LIST_ITEMS else [_shortened(v) for v in value]
    return value


def format_value(value) -> str:
    return cut(repr(_shortened(value)), MAX_VALUE_CHARS)  # repr escapes newlines, so every key stays on one line


def printable(name: str) -> str:
    """A key or name from the file as one line of plain text: control
    characters (a newline forging a row, a terminal escape) escaped as repr
    escapes them."""
    return name if name.isprintable() else repr(name)[1:-1]


def short_name(name: str) -> str:
    """printable(name), cut to MAX_NAME_CHARS: a table pads every row to its
    longest name, so one name of a megabyte would pad every row to one."""
    return cut(printable(name), MAX_NAME_CHARS)


def format_shape(shape) -> str:
    return "x".join(str(d) for d in shape)


def print_inspect(f: GGUFFile) -> None:
    print(f"{f.path}: GGUF v{f.version}, alignment {f.alignment}, "
          f"{len(f.metadata)} metadata keys, {len(f.tensors)} tensors")
    print()
    for key, value in f.metadata.items():
        print(f"{short_name(key)} = {format_value(value)}")
    print()
    header = ("name", "type", "shape", "bytes", "bpw")
    rows = [(short_name(t.name), t.type_name, format_shape(t.shape), str(t.nbytes), f"{t.bits_per_weight:.2f}")
            for t in f.tensors.values()]
    print_table(header, rows, left_columns=2)  # name and type left-aligned, numbers right-aligned
    total_bytes = sum(t.nbytes for t in f.tensors.values())
    total_elements = sum(t.n_elements for t in f.tensors.values())
    average_bpw = 8 * total_bytes / total_elements if total_elements else 0.0
    print(f"total: {len(f.tensors)} tensors, {total_bytes} bytes, {average_bpw:.2f} bits per weight")


def print_table(header, rows, left_columns: int) -> None:
    """Columns padded to their widest cell; the first `left_columns` left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) if i < left_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def has_act_order(layer: GPTQLinear) -> bool:
    """Whether g_idx scatters rows over groups; an all-zero or trivial (k // G) g_idx is no act-order."""
    K = layer.in_features
    G = K if layer.group_size == -1 else layer.group_size
    trivial = torch.arange(K, dtype=layer.g_idx.dtype, device=layer.g_idx.device) // G
    return bool(layer.g_idx.any()) and not torch.equal(layer.g_idx, trivial)


def quant_bytes(layer: GPTQLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.qweight, layer.qzeros, layer.scales, layer.g_idx))


def print_gptq_inspect(path: str) -> None:
    ckpt = load_gptq(path)
    print(f"{path}: GPTQ checkpoint, {len(ckpt.modules)} quantized modules, {len(ckpt.tensors)} other tensors")
    print(f"quantization config ({ckpt.config.source}):")
    for key, value in ckpt.config.to_dict().items():
        print(f"  {key} = {format_value(value)}")
    print()
    header = ("name", "bits", "group", "act-order", "sym", "format", "shape", "bytes", "bpw")
    rows = [(short_name(name), str(m.bits), str(m.group_size), "yes" if has_act_order(m) else "no",
             "yes" if m.sym else "no",
             m.checkpoint_format, f"{m.out_features}x{m.in_features}", str(quant_bytes(m)),
             f"{8 * quant_bytes(m) / (m.in_features * m.out_features):.2f}")
            for name, m in ckpt.modules.items()]
    print_table(header, rows, left_columns=1)
    total_bytes = sum(quant_bytes(m) for m in ckpt.modules.values())
    total_weights = sum(m.in_features * m.out_features for m in ckpt.modules.values())
    average_bpw = 8 * total_bytes / total_weights if total_weights else 0.0
    print(f"total: {len(ckpt.modules)} modules, {total_weights} weights, {total_bytes} bytes, "
          f"{average_bpw:.2f} bits per weight")


def cmd_inspect(args) -> None:
    if is_gguf_path(args.path):
        with load_gguf(args.path) as f:
            print_inspect(f)
    else:
        print_gptq_inspect(args.path)


def cmd_convert_gptq(args) -> None:
    s = convert_checkpoint(args.src, args.dst, to=GPTQ_FORMATS[args.to])
    print(f"converted {s['source']} ({s['from']}) -> {s['destination']} ({s['to']}): {s['modules']} modules, "
          f"{s['tensors']} tensors, {s['shards']} shard{'s' if s['shards'] != 1 else ''}")


class _TimedStreamer:
    """A transformers generation streamer that prints new text as it comes and
    notes when each step's tokens arrived (the first put is the prompt).

    Each step decodes a short window, not the whole output: the tokens printed
    last (context, so that a decoder that treats a text's first token apart,
    SentencePiece's leading space, decodes the new ones as in the whole text)
    and those not printed yet. The window's text less the context's is what is
    new; the work per step stays the same however long the output grows.

    Ids past the tokenizer's tokens (a model whose embedding has rows for
    padding) have no text: they are kept out of the text and noted in
    `undecodable`, for the command to report (decode would drop them without
    a word, or fail, as a SentencePiece tokenizer does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.arrivals = []
        self.tokens = []  # the generated ids that have text
        self.undecodable = []  # the generated ids past the tokenizer's
        self.generated = 0  # ids generated, of both kinds
        self.vocabulary = len(tokenizer)
        self.context = 0  # tokens[context:printed]: the tokens printed last, decoded again as context
        self.printed = 0  # tokens[:printed] are printed

    def put(self, ids) -> None:
        self.arrivals.append(time.perf_counter())
        if len(self.arrivals) == 1:
            return
        for i in ids.reshape(-1).tolist():
            (self.tokens if 0 <= i < self.vocabulary else self.undecodable).append(i)
            self.generated += 1
        self._print(final=False)

    def end(self) -> None:
        self._print(final=True)
        print(flush=True)

    def _print(self, final: bool) -> None:
        if self.printed == len(self.tokens):
            return
        window = self.tokens[self.context:]
        text = self.tokenizer.decode(window, skip_special_tokens=True)
        # A character whose bytes span tokens (an emoji, CJK in byte-level BPE)
        # decodes as U+FFFD until its last byte comes: held till then, or the
        # end. A run longer than any character's bytes is not one being
        # completed (bytes that are not UTF-8): printed, as decode gives it.
        held = len(self.tokens) - self.printed
        if not final and text.endswith("\ufffd") and held <= MAX_HELD_TOKENS:
            return
        before = self.tokenizer.decode(window[:self.printed - self.context], skip_special_tokens=True)
        # The context's text is where the window's begins, but for a joint the
        # new tokens change (a decoder's space clean-up): what differs is printed.
        same = len(os.path.commonprefix([before, text]))
        print(text[same:], end="", flush=True)
        self.context, self.printed = self.printed, len(self.tokens)


def load_model_and_tokenizer(path: str, repack: bool | None = None, int8_activations: bool = False,
                             float_tables: str | None = None, check_tensors: bool = False):
    """A .gguf file's model and tokenizer (both from the file; `check_tensors`:
    load_gguf_model's), or a GPTQ checkpoint directory's (the tokenizer saved
    beside the weights; `int8_activations` and `float_tables`:
    load_gptq_model's). `repack` is the loaders' (lowbit.repack_model: the
    layers the active CPU kernels read faster in their repacked layout moved
    into it); None, as the generate command has it unless told otherwise, is
    True without repack_model's warning about the types this CPU's kernels
    leave in the file's layout (nothing was asked of those)."""
    from .gguf.model import load_gguf_model, load_gguf_tokenizer
    from .gptq.placing import load_gptq_model

    if is_gguf_path(path):
        for flag, given in (("--int8-activations", int8_activations), ("--float-tables", float_tables)):
            if given:
                raise ValueError(f"{path}: {flag} is for GPTQ checkpoints (a GGUF file's types fix theirs)")
        with _quiet_default_repack(repack):
            model = load_gguf_model(path, repack=repack is not False, check_tensors=check_tensors)
        return model, load_gguf_tokenizer(path)
    import transformers

    # A single .safetensors file's checkpoint is its directory, which holds the tokenizer as well;
    # looked for before the model loads (a minute for a large one), where the path is there at all.
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{path}: no tokenizer beside the checkpoint (none of {', '.join(TOKENIZER_FILES)})")
    with _quiet_default_repack(repack):
        model = load_gptq_model(path, int8_activations=int8_activations, float_tables=float_tables,
                                repack=repack is not False)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers indexes the files' JSON with no checks of its own (KeyError, TypeError)
        reason = " ".join(str(e).split())  # one line: transformers' messages run over several
        raise ValueError(f"{path}: the tokenizer beside the checkpoint does not load: {type(e).__name__}: "
                         f"{reason}") from e
    vocab = model.config.vocab_size  # the embedding's rows; a tokenizer may have fewer (padding), never more
    if len(tokenizer) > vocab:
        raise ValueError(f"{path}: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {vocab}")
    return model, tokenizer


@contextlib.contextmanager
def _quiet_default_repack(repack: bool | None):
    """Ignores repack_model's warning about types left in the file's layout
    where repacking is the default rather than asked for."""
    with warnings.catch_warnings():
        if repack is None:
            warnings.filterwarnings("ignore", message="lowbit.repack_model: ")
        yield


def chat_prompt(path: str, tokenizer, prompt: str, max_chars: int,
                seconds: float = TEMPLATE_SECONDS) -> torch.Tensor:
    """The prompt in the checkpoint's chat template, as token ids. The
    template comes from the file: it renders in a child process under
    `seconds` and TEMPLATE_BYTES (lowbit._bounded), its errors name the
    file, and a rendering longer than `max_chars`, or adding more than
    TEMPLATE_CHARS to the prompt, is refused before it is tokenized."""
    # A context of billions of positions (the file's word) bounds nothing: tokenizing a
    # template's 100 MB takes minutes and gigabytes, where a chat format adds a few lines.
    max_chars = min(max_chars, len(prompt) + TEMPLATE_CHARS)
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise ValueError(f"{path}: --chat needs a chat template, and this tokenizer has "
                         f"{'none' if template is None else 'several, or one that is not text'}")

    def render():
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return text if len(text) <= max_chars else len(text)  # only the length of a text too long comes back

    try:
        text = run_bounded(render, seconds, TEMPLATE_BYTES)
    except BoundedError as e:
        # The message is the template's to write (raise_exception's text): one line, escaped and cut.
        reason = cut(printable(str(e)), MAX_REASON_CHARS)
        raise ValueError(f"{path}: its chat template does not render: {reason}") from None
    if not isinstance(text, str):
        raise ValueError(f"{path}: its chat template renders {text} characters, more than {max_chars}")
    if not text:
        raise ValueError(f"{path}: its chat template renders no text")
    try:  # a template can write lone surrogates ('\ud800'), which no tokenizer takes
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path}: its chat template renders text that is not UTF-8: {text[e.start]!r} at "
                         f"character {e.start}") from None
    # The template writes its own special tokens (BOS): the tokenizer adds none.
    return tokenize(path, tokenizer, text, add_special_tokens=False)


def tokenize(path: str, tokenizer, text: str, **kwargs) -> torch.Tensor:
    """The text's token ids. A checkpoint's tokenizer config reaches
    tokenizing unchecked (a model_max_length of "x" fails a comparison
    there): what it raises is an error naming the file."""
    try:
        return tokenizer(text, return_tensors="pt", **kwargs).input_ids
    except Exception as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"{path}: its tokenizer does not tokenize the prompt: {type(e).__name__}: {reason}") from e


def static_cache_bytes(model, positions: int) -> int | None:
    """The bytes of transformers' static cache of `positions` for one sequence:
    keys and values of every layer, in the model's dtype (None for a model
    without attention heads, Mamba's or RWKV's)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * positions * model.dtype.itemsize


def physical_memory() -> int | None:
    """The machine's memory in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def sampling(args) -> dict:
    """generate's keyword arguments for the sampling options: greedy at
    temperature 0, where top-k and top-p have nothing to cut."""
    if args.temperature == 0:
        for flag, given in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed)):
            if given is not None:
                raise ValueError(f"{flag} is for sampling: pass --temperature above 0 as well")
        return {"do_sample": False}
    if args.temperature < MIN_TEMPERATURE:  # logits / T past float32's range: NaN probabilities
        raise ValueError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {args.temperature:g}")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    # transformers' own defaults (top_k 50) would cut what was not asked for: off unless given.
    return {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k or 0,
            "top_p": 1.0 if args.top_p is None else args.top_p}


def cmd_generate(args) -> None:
    from .generation import compiled_decoding

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # before loading: the loaders give lowbit's kernels torch's count
    options = sampling(args)
    try:  # bytes the locale could not decode reach Python as lone surrogates, which no tokenizer takes
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not UTF-8 text: byte {args.prompt[e.start].encode('utf-8', 'surrogateescape')!r} "
                         f"at character {e.start}") from None
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(args.path, args.repack, args.int8_activations, args.float_tables,
                                                args.check_tensors)
    compiled_decoding(model, args.compile)
    loaded = time.perf_counter() - start
    # None where the model's positions have no fixed count (ALiBi: Bloom, MPT).
    context = getattr(model.config, "max_position_embeddings", None)
    if args.chat:  # a template's text beyond MAX_CHARS_PER_TOKEN per position of the context cannot fit it
        ids = chat_prompt(args.path, tokenizer, args.prompt, MAX_CHARS_PER_TOKEN * context if context else sys.maxsize)
    else:
        ids = tokenize(args.path, tokenizer, args.prompt)
    if ids.shape[1] == 0:  # a tokenizer that adds no BOS gives an empty prompt nothing to continue
        raise ValueError(f"{args.path}: the prompt {args.prompt!r} tokenizes to no tokens (this tokenizer adds "
                         "no BOS token): give some text")
    # Positions past the context are ones the model was not trained for (and --compile sizes its cache by them).
    if context is not None and ids.shape[1] + args.tokens > context:
        raise ValueError(f"--tokens {args.tokens} after a prompt of {ids.shape[1]} tokens exceeds the "
                         f"model's context of {context} positions")
    if args.compile:  # the static cache is allocated whole at the first step: one past memory fails there
        need, have = static_cache_bytes(model, ids.shape[1] + args.tokens), physical_memory()
        if need is not None and have is not None and need > have:
            raise ValueError(f"--compile: a static cache of {ids.shape[1] + args.tokens} positions takes "
                             f"{need / 2**30:.1f} GiB, more than this machine's {have / 2**30:.1f} GiB of memory: "
                             "ask fewer --tokens")
    print(f"{args.path}: {type(model).__name__}, loaded in {loaded:.1f} s; prompt {ids.shape[1]} tokens", file=sys.stderr)
    streamer = _TimedStreamer(tokenizer)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, streamer=streamer,
                       pad_token_id=tokenizer.eos_token_id, **options)
    prompt_s = streamer.arrivals[1] - streamer.arrivals[0]
    # Compiled, the first decode step compiles: the rate counts the steps after it.
    first = 2 if args.compile else 1
    steps = len(streamer.arrivals) - 1 - first
    decode = f", decode {steps / (streamer.arrivals[-1] - streamer.arrivals[first]):.1f} tokens/s" if steps > 0 else ""
    if args.compile and len(streamer.arrivals) > 2:
        decode += f" after a first step that compiled in {streamer.arrivals[2] - streamer.arrivals[1]:.1f} s"
    threads = torch.get_num_threads()
    print(f"prefill {ids.shape[1] / prompt_s:.1f} tokens/s{decode} ({streamer.generated} new tokens"
          f"{undecodable_note(streamer)}, {threads} thread{'s' if threads != 1 else ''})", file=sys.stderr)


def undecodable_note(streamer: _TimedStreamer) -> str:
    """How many of the generated ids the tokenizer has no text for, and the
    first few of them ("" where there are none). The rate counts them (the
    model computed each); the text has nothing of them."""
    ids = streamer.undecodable
    if not ids:
        return ""
    shown = ", ".join(map(str, ids[:MAX_LIST_ITEMS])) + (", ..." if len(ids) > MAX_LIST_ITEMS else "")
    return (f", {len(ids)} of them ids past the tokenizer's {streamer.vocabulary} tokens, with no text in the "
            f"output: {shown}")


def int_in(low: int, high: int):
    """An argparse type: a whole number in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must lie in [{low}, {high}], got {value}")
        return value
    return parse


def number_in(low: float, high: float, low_open: bool = False):
    """An argparse type: a finite float in [low, high] ((low, high] with low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"must lie in {'(' if low_open else '['}{low}, {high}], got {text}")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit", description="lowbit tools")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print a GGUF file's metadata and tensor table, or a GPTQ "
                                                  "checkpoint's quantization config and module table")
    inspect.add_argument("path", help="a .gguf file, or a GPTQ checkpoint directory or .safetensors file")
    inspect.set_defaults(run=cmd_inspect)
    convert = commands.add_parser("convert-gptq", help="write a copy of a GPTQ checkpoint with v1 or v2 zero points")
    convert.add_argument("src", help="GPTQ checkpoint directory (only read)")
    convert.add_argument("dst", help="new directory to write (must not exist)")
    convert.add_argument("--to", required=True, choices=sorted(GPTQ_FORMATS),
                         help="v1 ('gptq', stores zero-1) or v2 ('gptq_v2', stores the zero)")
    convert.set_defaults(run=cmd_convert_gptq)
    generate = commands.add_parser("generate", help="continuation of PROMPT (greedy, or sampled with "
                                                    "--temperature) by a GGUF file's model ("
                                                    + ", ".join(ARCHITECTURES) + ") or a GPTQ "
                                                    "checkpoint's model, with its speed")
    generate.add_argument("path", help="a .gguf file, or a GPTQ checkpoint directory (or its .safetensors file) "
                                       "with its tokenizer")
    generate.add_argument("prompt")
    generate.add_argument("--tokens", type=int_in(1, 2**31 - 1), default=32, help="new tokens at most (default 32)")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the file's chat template")
    generate.add_argument("--temperature", type=number_in(0.0, 100.0), default=0.0,
                          help="sample at this temperature (default 0: greedy)")
    generate.add_argument("--top-k", type=int_in(1, 2**31 - 1), help="sample from the k most likely tokens only")
    generate.add_argument("--top-p", type=number_in(0.0, 1.0, low_open=True),
                          help="sample from the smallest set of tokens whose probabilities reach p")
    generate.add_argument("--seed", type=int_in(0, 2**64 - 1),
                          help="the sampler's random seed (the same text for the same seed)")
    generate.add_argument("--threads", type=int_in(1, MAX_POOL_THREADS),
                          help="CPU threads (default: torch's, one per physical core)")
    generate.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                          help="the layers the CPU kernels read faster in their repacked layout held in it "
                               "(lowbit.repack_model; the default, as llama.cpp repacks; --no-repack keeps the "
                               "file's memory-mapped bytes): GGUF types the active kernels read repacked "
                               "(torch.ops.lowbit.cpu_reads_repacked) but dense Q6_K, each layer's results the "
                               "same, for the 32-element types to fp32 rounding (which can flip an 8-bit "
                               "activation rounding downstream); GPTQ: the panel layout (the same results)")
    generate.add_argument("--int8-activations", action="store_true",
                          help="GPTQ: activations rounded to int8 per group for integer dot products "
                               "(GPTQLinear.int8_activations): faster on the CPU, about 2^-8 of the products' "
                               "magnitude from the float result")
    generate.add_argument("--float-tables", choices=["Q8_0", "Q6_K"],
                          help="GPTQ: the float token embedding and LM head held as Q8_0 (or Q6_K) blocks, "
                               "quantized at load as llama.cpp does (load_gptq_model's float_tables): about half "
                               "(Q6_K: two fifths) of their memory and the head's reads per token")
    generate.add_argument("--check-tensors", action="store_true",
                          help="GGUF: decode every tensor at load and refuse one holding a NaN or infinity (a "
                               "corrupt block scale), as llama.cpp's --check-tensors (load_gguf_model's "
                               "check_tensors; about 2.5 s per GB); a GPTQ checkpoint's scales are always checked")
    generate.add_argument("--compile", action="store_true",
                          help="static KV cache and compiled decode steps (lowbit.compiled_decoding): faster "
                               "steps after a first one that compiles (about a minute on 2 cores); not for "
                               "models with sliding-window layers (Gemma 2 and 3, gpt-oss)")
    generate.set_defaults(run=cmd_generate)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except BrokenPipeError:  # the reader of the output went (| head): it took what it wanted, no error to tell
        try:  # Python flushes stdout at exit: into devnull, that flush has no pipe to fail on
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no descriptor (captured)
            pass
        return 1
    except (ValueError, OSError) as e:  # GGUFError, GPTQConfigError, GPTQCheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
