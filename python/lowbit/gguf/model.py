"""A GGUF file becomes a model: load_gguf_model builds the transformers model
its metadata describes (lowbit.gguf.arch) on the meta device and
place_gguf_tensors fills it (replace_linear's GGUF work), so no float copy
of a linear layer's weight nor of the token embedding is made at any point:
a model needs about its file's size in memory, not its float size;
load_gguf_tokenizer builds the file's tokenizer."""
from __future__ import annotations

import json
import math
import os
import tempfile
import warnings

import torch
from torch import nn

from .._checks import check_finite, check_flag, check_path, check_positive, shown, shown_names, shown_text
from .._placing import (GGUF_SAVE_ADVICE, ReplaceReport, checked, get_module, load_tensor, model_dtype, on_meta,
                        rebuild_computed_buffers, refuse_save_pretrained, tensor_holders)
from ..fusing import fuse_projections
from ..moe import experts_dims
from ..decoding import fast_decoding
from ..threads import kernel_threads
from .arch import (ARCHITECTURES, _Metadata, _vocab_size, architecture, check_block_count, check_not_split,
                   config_from_gguf, expert_modules, hf_name, hf_value, rows_in_hf_order)
from .embedding import GGUFEmbedding
from .experts import ClampedSwiGLU, GGUFExperts
from .file import GGUFError, GGUFFile, GGUFTensor, load_gguf
from .linear import GGUFLinear
from .pre_tokenizer import split_as_llama_cpp
from .repacking import repack_model

__all__ = ["load_gguf_model", "load_gguf_tokenizer", "place_gguf_tensors"]

# llama.cpp's converter stores Llama 3.1+'s rope scaling as per-frequency
# divisors in this tensor instead of metadata.
ROPE_FREQS = "rope_freqs.weight"
TOKEN_EMBD = "token_embd.weight"
# A phi3 LongRoPE file's per-frequency factors, which its config holds (config_from_gguf).
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def load_gguf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, repack: bool = False,
                    fuse: bool = True, check_tensors: bool = False) -> nn.Module:
    """The transformers model (lowbit.gguf.arch.ARCHITECTURES: LlamaForCausalLM,
    or MixtralForCausalLM for a llama file with experts, SmolLM3ForCausalLM,
    GraniteForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM, GptOssForCausalLM, GemmaForCausalLM,
    Gemma2ForCausalLM, Gemma3ForCausalLM or Phi3ForCausalLM) that a GGUF file of one of those
    architectures describes, in eval mode on the CPU.

    Every linear layer the file has a quantized weight for is a GGUFLinear
    over the file's blocks (memory-mapped, so loading reads no weight
    bytes), a mixture-of-experts layer's experts a GGUFExperts (the file's
    3-D expert tensors over the same mapping, one ggml_mul_mat_id per
    projection), the token embedding a
    GGUFEmbedding over its blocks (rows dequantized as they are looked up);
    norms, biases and routers are dequantized to `dtype`. Move it
    with `.to(device)`. Unlike transformers' own GGUF loading, no float copy
    of a weight matrix is ever made: the model takes about its file's size.
    `fuse` joins the projections each decoder layer calls on one input (q,
    k and v; gate and up) into one GGUFLinear where their types match
    (lowbit.fusing: `qkv_proj`, `gate_up_proj`, with a ProjectionSlice in
    each projection's place): one matmul instead of two or three, over the
    file's own bytes where it stores them back to back.
    `repack` is lowbit.repack_model: the layers of the types the active CPU
    kernels read repacked (but dense Q6_K ones, which run as fast in the
    file's layout; experts take every type) in the kernels' interleaved
    layout (GGUFLinear.repack: the same results, for the 32-element types to
    fp32 rounding; faster on AVX-512 VNNI CPUs and for most of those types
    on AVX2 ones), which copies their blocks out of the mapping.
    `check_tensors` decodes every tensor of the file first and refuses one
    holding a NaN or infinity (GGUFTensor.check_finite), as llama.cpp's
    --check-tensors does; without it a corrupt block scale turns the outputs
    it reaches NaN. It decodes the whole file (about 2.5 s per GB on 2 cores).
    Its forward calls run torch's ops on one thread and lowbit's kernels on
    torch's thread count (lowbit.kernel_threads), and a llama-family model's
    decode steps skip transformers' per-layer machinery (lowbit.fast_decoding).
    """
    import transformers

    dtype = model_dtype(dtype, "load_gguf_model")
    path = check_path("load_gguf_model", path)
    repack, fuse = check_flag("load_gguf_model", "repack", repack), check_flag("load_gguf_model", "fuse", fuse)
    check_tensors = check_flag("load_gguf_model", "check_tensors", check_tensors)
    where = f"load_gguf_model: {path}"
    f = load_gguf(path)
    if check_tensors:
        for t in f.tensors.values():
            t.check_finite(where)
    check_not_split(f.metadata, where)
    spec = architecture(f.metadata, where)
    # The layer count against the file's layers first: the model is built
    # with as many as its config says, before any tensor is placed.
    check_block_count(f.metadata, f.tensors, where)
    model_class = getattr(transformers, spec.model_class)
    kwargs = config_from_gguf(f.metadata, f.tensors, where)
    model = on_meta(lambda: model_class.config_class(**kwargs), model_class, dtype, where, GGUFError)
    _embed_tokens_from_blocks(model, f, dtype, spec.scaled_embedding)
    place_gguf_tensors(model, f, "load_gguf_model", consumed=(ROPE_FREQS, TOKEN_EMBD, *ROPE_FACTORS))
    rebuild_computed_buffers(model, where, GGUFError)
    _apply_rope_freqs(model, f)
    if fuse:
        fuse_projections(model, f)
    if repack:
        repack_model(model)
    kernel_threads(model)
    fast_decoding(model)
    return checked(model, where, GGUFError)


def _embed_tokens_from_blocks(model: nn.Module, f: GGUFFile, dtype: torch.dtype, scaled: bool) -> None:
    """The token embedding as a GGUFEmbedding over the file's blocks (rows
    dequantized as they are looked up; a tied LM head multiplies by the same
    blocks), where a float table would be the model's largest tensor. Where
    the model's own embedding scales its output (`scaled`: the Gemma
    models' ScaledWordEmbedding, by sqrt(hidden_size)), the GGUFEmbedding does."""
    embd = f.tensors.get(TOKEN_EMBD)
    if embd is None:
        return  # replace_linear reports the missing parameter
    current = model.get_input_embeddings()
    check_shape(f.path, embd, "the config's token embedding", tuple(current.weight.shape))
    if scaled != hasattr(current, "embed_scale"):  # a transformers version that scales elsewhere
        raise RuntimeError(f"load_gguf_model: {type(current).__name__} of {type(model).__name__} "
                           f"{'does not scale' if scaled else 'scales'} its embeddings, which lowbit does not expect")
    scale = model.config.hidden_size ** 0.5 if scaled else None
    model.set_input_embeddings(GGUFEmbedding(embd.data, embd.type, embd.shape[1], dtype, scale))


def load_gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer that transformers builds from the file's
    tokenizer.ggml.* metadata: AutoTokenizer's class for the file's
    architecture, built straight from the file (0.3 s for SmolLM2's, against
    AutoTokenizer's 3-4 s). Architectures lowbit does not know go through
    AutoTokenizer itself."""
    import transformers

    path = check_path("load_gguf_tokenizer", path)
    where = f"load_gguf_tokenizer: {path}"
    f = load_gguf(path)
    metadata = f.metadata
    _check_tokenizer_metadata(metadata, where)
    embd = f.tensors.get(TOKEN_EMBD)
    tokens = len(metadata["tokenizer.ggml.tokens"])
    if embd is not None and embd.shape[0] < tokens:  # ids past the embedding's rows (fewer tokens: padding rows)
        raise GGUFError(f"{where}: tokenizer.ggml.tokens has {tokens} tokens, {TOKEN_EMBD} only {embd.shape[0]} rows")
    arch = metadata.get("general.architecture")
    spec = ARCHITECTURES.get(arch) if isinstance(arch, str) else None  # a list would be unhashable
    tokenizer_class = spec.tokenizer_class if spec else None
    builder = transformers.AutoTokenizer if tokenizer_class is None else getattr(transformers, tokenizer_class)
    # from_pretrained reads a tokenizer.json or tokenizer_config.json in its
    # directory before the file (convert_hf_to_gguf.py writes into the HF
    # model's directory): it is given an empty one, and the file's absolute path.
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.TemporaryDirectory() as alone:
        try:
            tokenizer = builder.from_pretrained(alone, gguf_file=os.path.abspath(path))
        except BaseException as e:  # transformers' converter indexes and parses the metadata with no checks of its own
            if not isinstance(e, Exception) and not _is_rust_panic(e):  # Ctrl-C, exit
                raise
            reason = shown_text(str(e).replace(alone, directory))
            raise GGUFError(f"{where}: transformers builds no tokenizer from its tokenizer.ggml.* metadata: "
                            f"{type(e).__name__}: {reason}") from e
    tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = directory  # not the empty one, which is gone
    _keep_byte_level_specials(tokenizer, metadata, where)
    _check_own_entries(tokenizer, metadata["tokenizer.ggml.tokens"], where)
    _check_unknown_characters(tokenizer, metadata, where)
    split_as_llama_cpp(tokenizer, metadata, where)
    if embd is not None and len(tokenizer) > embd.shape[0]:  # special tokens the class adds past the file's list
        raise GGUFError(f"{where}: transformers' {type(tokenizer).__name__} holds {len(tokenizer)} tokens "
                        f"(the file's {tokens} and those it adds), {TOKEN_EMBD} only {embd.shape[0]} rows")
    return tokenizer


CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types of tokens it matches whole in a text


def _keep_byte_level_specials(tokenizer, metadata, where: str) -> None:
    """A byte-level ("gpt2") vocabulary's control and user-defined tokens
    that are not spelled in the byte alphabet (DeepSeek's
    "<｜begin▁of▁sentence｜>") as added tokens at the file's ids, as
    llama.cpp matches them. transformers' converter stores them respelled
    byte by byte and leaves them out of its added tokens; setting the BOS or
    EOS to such a token's text then appends it at a new id past the file's
    tokens, so every prompt began with an id the model has no trained row for."""
    if metadata.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.token_type" not in metadata:
        return
    from tokenizers import AddedToken, Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    whole = {}  # text -> (id, control)
    for i, (text, kind) in enumerate(zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"])):
        if kind in (CONTROL, USER_DEFINED) and text and not set(text) <= alphabet:
            whole[text] = (i, kind == CONTROL)
    if not whole:
        return
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    for text, (i, _) in whole.items():
        respelled = "".join(spelling[b] for b in text.encode("utf-8"))
        if vocab.get(respelled) == i:
            del vocab[respelled]
        vocab[text] = i
    # The converter's own additions of these texts (at new ids) go; the rest stay as they are.
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] not in whole]
    _renumber_template(state.get("post_processor"), {text: i for text, (i, _) in whole.items()})
    try:
        tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
    except Exception as e:  # a merge that needs a respelled token
        raise GGUFError(f"{where}: its byte-level vocabulary's special tokens do not fit its merges: "
                        f"{shown_text(e)}") from e
    # Added as the converter adds those it keeps, now found in the vocabulary at the file's ids.
    control = [AddedToken(t, normalized=False, special=True) for t, (_, c) in whole.items() if c]
    user = [AddedToken(t, normalized=False, special=False) for t, (_, c) in whole.items() if not c]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    if user:
        tokenizer.add_tokens(user)


def _check_own_entries(tokenizer, tokens: list[str], where: str) -> None:
    """Each of the file's ids an entry of its own in the vocabulary that
    transformers built. A text the file repeats (which llama.cpp refuses) or
    two texts transformers spells alike (a byte-level vocabulary's " ",
    respelled "Ġ", beside "Ġ") keep one id between them: the other decodes as
    nothing, and a token the class adds takes the vocabulary's length for its
    id, which is one of the file's."""
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    kept = set(vocab.values())
    lost = next((i for i in range(len(tokens)) if i not in kept), None)
    if lost is None:
        return
    text = tokens[lost]
    holder = vocab.get(text)  # the id that took its entry, where transformers spells it as the file does
    said = shown(text)
    if holder is None or holder >= len(tokens):
        problem = f"token {lost} {said} has no entry of its own in transformers' vocabulary"
    elif tokens[holder] == text:
        problem = f"tokens {lost} and {holder} are both {said}"
    else:
        problem = (f"tokens {lost} {said} and {holder} {shown(tokens[holder])} are one entry {said} of "
                   "transformers' vocabulary")
    raise GGUFError(f"{where}: metadata 'tokenizer.ggml.tokens': {problem}; each id needs a text of its own")


BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def _check_unknown_characters(tokenizer, metadata, where: str) -> None:
    """A sentencepiece ("llama") vocabulary encodes a character it has no
    token for as its UTF-8 bytes' tokens (<0x00>..<0xFF>), or else as the
    unknown token transformers' model has. With neither, transformers'
    tokenizer raises a bare Exception on such a text (or drops the character)
    and llama.cpp aborts: refused at load rather than at the first such text."""
    if metadata.get("tokenizer.ggml.model") != "llama":
        return
    model = tokenizer.backend_tokenizer.model
    missing = next((b for b in BYTE_TOKENS if model.token_to_id(b) is None), None)
    unk = getattr(model, "unk_token", None)
    if missing is None or (unk is not None and model.token_to_id(unk) is not None):
        return
    raise GGUFError(f"{where}: metadata 'tokenizer.ggml.tokens': its sentencepiece ('llama') vocabulary has no "
                    f"byte token {missing}, and transformers' {type(tokenizer).__name__} no unknown token among its "
                    "tokens, so a character outside the vocabulary cannot be encoded (llama.cpp aborts on one)")


def _renumber_template(node, ids: dict) -> None:
    """The BOS and EOS a post-processor template adds (its special_tokens'
    {"<s>": {"ids": [...]}}, at any depth of a sequence) at `ids`' ids."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ids and isinstance(value, dict) and "ids" in value:
                value["ids"] = [ids[key]]
            else:
                _renumber_template(value, ids)
    elif isinstance(node, list):
        for value in node:
            _renumber_template(value, ids)


def _is_rust_panic(e: BaseException) -> bool:
    """Whether `e` is a Rust panic that pyo3 raised (tokenizers' BPE panics on
    a merge whose result is missing from the vocabulary and longer than any
    token in it). pyo3 derives PanicException from BaseException, not
    Exception, and gives it no importable module: it is told by name."""
    return type(e).__name__ == "PanicException"


# The keys a tokenizer.ggml.model needs besides its tokens: transformers' converter
# derives a sentencepiece vocabulary's merges from its scores (llama.cpp reads 0
# where they are missing) and builds a unigram one from them; llama.cpp refuses a
# BPE vocabulary without its merges.
NEEDS_SCORES = {"llama": "sentencepiece", "t5": "unigram"}
NEEDS_MERGES = {"gpt2": "byte-level", "gemma4": "BPE"}
MAX_TOKEN_WORK = 1 << 32  # sum of squared token lengths: a real vocabulary's is about 10^7
# The special tokens transformers' converter looks up by id in the token list.
_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _check_tokenizer_metadata(metadata, where: str) -> None:
    """The token list and what the converter indexes by it, checked first so
    that the error names the key: a list of strings, per-token types and
    scores at least as long as it (llama.cpp reads no further), special token
    ids inside it (a negative one would index from its end). The scores or
    merges the model's converter needs (NEEDS_SCORES, NEEDS_MERGES), each
    merge two tokens joined by a space."""
    m = _Metadata(metadata, where)
    model = m.get("tokenizer.ggml.model", str)
    key = "tokenizer.ggml.tokens"
    tokens = m.get(key, list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise m.error(key, "must be a non-empty list of strings")
    # transformers' converter derives a sentencepiece vocabulary's merges by
    # trying every split of every token: time growing with each token's
    # length squared, minutes for one token of a megabyte.
    work = sum(len(t) ** 2 for t in tokens)
    if work > MAX_TOKEN_WORK:
        longest = max(tokens, key=len)
        raise m.error(key, f"its tokens' squared lengths sum to {work}, more than {MAX_TOKEN_WORK} (the longest "
                           f"token has {len(longest)} characters; a vocabulary's have tens)")
    for field, kind in (("token_type", int), ("scores", float)):
        key = f"tokenizer.ggml.{field}"
        values = m.get(key, list, None)
        if values is None:
            if field == "scores" and model in NEEDS_SCORES:
                raise m.error(key, f"missing: a {NEEDS_SCORES[model]} ({model!r}) vocabulary needs each token's score")
            continue
        if len(values) < len(tokens):
            raise m.error(key, f"has {len(values)} values, fewer than the {len(tokens)} tokens of "
                               "tokenizer.ggml.tokens")
        allowed = (int, float) if kind is float else int
        wrong = next((v for v in values if not isinstance(v, allowed) or isinstance(v, bool)), None)
        if wrong is not None:
            raise m.error(key, f"must hold {'numbers' if kind is float else 'integers'}, one per token; "
                               f"holds {type(wrong).__name__} {shown(wrong)}")
        if kind is float and not all(map(math.isfinite, values)):  # a NaN score orders no merge
            raise m.error(key, "must be finite, one per token; holds NaN or infinity")
    _check_merges(m, model)
    for field in _SPECIAL_TOKEN_IDS:
        key = f"tokenizer.ggml.{field}"
        token = m.get(key, int, None, minimum=0)
        if token is not None and token >= len(tokens):
            raise m.error(key, f"token {token} is outside the {len(tokens)} tokens of tokenizer.ggml.tokens")
    for field in ("add_bos_token", "add_eos_token", "add_space_prefix"):  # a string "false" would read as true
        m.get(f"tokenizer.ggml.{field}", bool, None)
    m.get("tokenizer.chat_template", str, None)
    arch = metadata.get("general.architecture")
    if isinstance(arch, str):
        _vocab_size(m, arch)  # the token list against {arch}.vocab_size


def _check_merges(m: _Metadata, model: str) -> None:
    """tokenizer.ggml.merges: required of a BPE vocabulary (NEEDS_MERGES), as
    llama.cpp requires them (transformers' converter would derive merges from
    scores such a file lacks); each a pair of tokens joined by one space,
    which is how transformers' converter splits them (a merge of one or three
    parts fails there with an error that names no key)."""
    key = "tokenizer.ggml.merges"
    merges = m.get(key, list, None)
    if merges is None:
        if model in NEEDS_MERGES:
            raise m.error(key, f"missing: a {NEEDS_MERGES[model]} ({model!r}) vocabulary needs its merges")
        return
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2 or not all(parts):
            raise m.error(key, f"merge {i} is {type(merge).__name__} {shown(merge)}, not two tokens "
                               "joined by one space")


def _apply_rope_freqs(model: nn.Module, f: GGUFFile) -> None:
    """The file's rope_freqs divisors, applied as llama.cpp does (theta / freq_factor)."""
    freqs = f.tensors.get(ROPE_FREQS)
    if freqs is None:
        return
    rotary = model.model.rotary_emb
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):  # gemma3's: one table per layer type
        raise GGUFError(f"load_gguf_model: {f.path}: {ROPE_FREQS}: the {type(model).__name__}'s rotary embedding "
                        "has no single frequency table for its divisors")
    if freqs.shape != tuple(rotary.inv_freq.shape):  # one divisor per frequency
        raise GGUFError(f"load_gguf_model: {f.path}: {ROPE_FREQS} has shape {freqs.shape}, "
                         f"the model's rotary embedding {tuple(rotary.inv_freq.shape)}")
    divisors = freqs.dequantize()
    check_positive(divisors, f"load_gguf_model: {f.path}: {ROPE_FREQS}")
    rotary.inv_freq = rotary.inv_freq / divisors
    rotary.original_inv_freq = rotary.inv_freq.clone()


# Config values a file fixes that change a model's results but no weight's
# shape: its heads, norm epsilon and rotary base, the experts each token
# takes, the Gemma models' softcaps and Granite's multipliers.
SHAPELESS_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "num_experts_per_tok", "attn_logit_softcapping", "final_logit_softcapping", "logits_scaling",
                  "embedding_multiplier", "residual_multiplier", "attention_multiplier")


def _config_value(config, key: str):
    if key == "rope_theta":  # transformers 5 keeps it in rope_parameters (per layer type in some models: not read)
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and isinstance(params.get("rope_theta"), (int, float)):
            return params["rope_theta"]
    return getattr(config, key, None)


def check_config_matches(model: nn.Module, f: GGUFFile, where: str) -> None:
    """A model built elsewhere (replace_linear) against the values of
    SHAPELESS_KEYS the file's metadata gives: heads of another size, another
    norm epsilon, rotary base or count of experts per token fit every weight
    and give other results. A
    model without a config is not compared."""
    config = getattr(model, "config", None)
    if config is None:
        return
    try:
        expect = config_from_gguf(f.metadata, f.tensors, where)
    except GGUFError:  # a key config_from_gguf refuses leaves the others binding
        expect = _shapeless_metadata(f.metadata, where)
    for key in SHAPELESS_KEYS:
        want, have = expect.get(key), _config_value(config, key)
        if not isinstance(want, (int, float)) or not isinstance(have, (int, float)):
            continue
        same = math.isclose(have, want, rel_tol=1e-6) if isinstance(want, float) else have == want
        if not same:
            raise GGUFError(f"{where}: the model's config has {key}={have!r}, the file's metadata {want!r}: the "
                            "weights fit both, the results would not be the file's model")


def _shapeless_metadata(metadata, where: str) -> dict:
    """SHAPELESS_KEYS' values as the file's metadata gives them, each read on
    its own (None where its key is unreadable), for a file whose metadata
    makes no whole config (no vocabulary size, a rope scaling lowbit does not
    build): its head counts, epsilon and rotary base still fix the results."""
    m = _Metadata(metadata, where)

    def read(key, kind, default=None):
        try:
            return m.get(key, kind, default, positive=kind is not str)
        except GGUFError:
            return None

    arch = read("general.architecture", str)
    if arch is None:
        return {}
    heads, hidden = read(f"{arch}.attention.head_count", int), read(f"{arch}.embedding_length", int)
    head_dim = hidden // heads if heads and hidden and hidden % heads == 0 else None
    return {"num_attention_heads": heads,
            "num_key_value_heads": read(f"{arch}.attention.head_count_kv", int, heads),
            "head_dim": read(f"{arch}.attention.key_length", int, head_dim),
            "rms_norm_eps": read(f"{arch}.attention.layer_norm_rms_epsilon", float),
            "rope_theta": read(f"{arch}.rope.freq_base", float, 10000.0)}


def place_gguf_tensors(model: nn.Module, f: GGUFFile, caller: str, consumed: tuple[str, ...] = ()) -> ReplaceReport:
    """replace_linear's GGUF work on an open file. File tensors with no place
    in the model are warned about (as `caller`), except those the caller
    uses itself (`consumed`). A model built on the meta device gets the
    file's float tensors as new parameters."""
    path = f.path
    check_not_split(f.metadata, f"{caller}: {path}")
    spec = architecture(f.metadata, f"{caller}: {path}")
    report = ReplaceReport()
    wanted = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    placed = set()
    in_experts = set(_place_experts(model, f, report, placed))
    holders = tensor_holders(model)

    # Linear weights first, so bias tensors find their (new) layers afterwards.
    tensors = sorted(f.tensors.values(), key=lambda t: not t.name.endswith(".weight"))
    for t in tensors:
        if t.name in in_experts:
            continue
        name = hf_name(t.name, spec)
        module_name, _, attr = (name or "").rpartition(".")
        module = get_module(model, module_name) if name else None
        if module is None or not hasattr(module, attr):
            report.unplaced.append(t.name)
            continue
        if isinstance(module, nn.Linear) and attr == "weight":
            # A one-output layer may come as a 1-D tensor (qwen2moe's shared-expert gate).
            one_row = module.out_features == 1 and len(t.shape) == 1
            shape = (module.out_features, module.in_features)
            check_shape(path, t, module_name, shape[1:] if one_row else shape)
            rows = rows_in_hf_order(t.name, t.data, f.metadata)
            layer = GGUFLinear.from_raw(rows, t.type, module.in_features, module.bias)
            if rows is not t.data:  # unpermuted into a copy: the mapped bytes were read once
                f.release([t.data])
            model.set_submodule(module_name, layer)
            report.replaced.append(module_name)
        else:
            target = getattr(module, attr)
            if target is None:  # a bias of a layer built without one (llama's attention_bias comes from blk.0)
                raise GGUFError(f"{caller}: {path}: tensor {shown(t.name)} is a {attr} of {module_name}, which "
                                "the model has none of")
            check_shape(path, t, name, tuple(target.shape))
            value = t.dequantize()
            # A corrupt norm would turn all after it NaN.
            check_finite(value, f"{path}: tensor {shown(t.name)}", GGUFError)
            value = hf_value(t.name, value, f.metadata)
            load_tensor(model, target, value, holders)
            report.loaded.append(name)
        placed.add(name)

    unexpected = [name for name in report.unplaced if name not in consumed]
    if unexpected:
        warnings.warn(f"{caller}: {path}: tensors with no place in the model: {shown_names(unexpected)}")
    _tie_lm_head(model, f, report, placed)
    missing = [n for n in wanted if n not in placed]
    if missing:
        raise GGUFError(f"{caller}: {path} has no tensor for model parameters {missing}")
    refuse_save_pretrained(model, GGUF_SAVE_ADVICE)
    return report


def _place_experts(model: nn.Module, f: GGUFFile, report: ReplaceReport, placed: set) -> list[str]:
    """Each layer's expert tensors as one GGUFExperts in place of the model's
    experts module (transformers' 3-D gate_up_proj and down_proj, [in, out]
    where the module says is_transposed, with biases where it has them:
    gpt-oss's, whose gated activation is its ClampedSwiGLU); returns the
    GGUF tensors it used."""
    used = []
    for module_name, parts in expert_modules(f.tensors).items():
        module = get_module(model, module_name)
        biased = getattr(module, "has_bias", False)
        wanted = {"gate", "up", "down"} | ({"gate.bias", "up.bias", "down.bias"} if biased else set())
        dims = experts_dims(module)
        if dims is None or set(parts) != wanted:
            continue  # not transformers' 3-D experts, or not all parts: reported unplaced by the caller
        tensors = {part: f.tensors[name] for part, name in parts.items()}
        experts, hidden, intermediate = dims
        shapes = {"gate": (experts, intermediate, hidden), "up": (experts, intermediate, hidden),
                  "down": (experts, hidden, intermediate)}
        for part, shape in shapes.items():
            check_shape(f.path, tensors[part], f"{module_name}'s {part} experts", shape)
            if biased:
                check_shape(f.path, tensors[f"{part}.bias"], f"{module_name}'s {part} experts' biases", shape[:2])
        biases = {p: tensors[f"{p}.bias"].dequantize() for p in shapes} if biased else None
        glu = ClampedSwiGLU(module.alpha, module.limit) if hasattr(module, "limit") else None
        layer = GGUFExperts(*((tensors[p].data, tensors[p].type) for p in ("gate", "up", "down")), experts=experts,
                            hidden_size=hidden, intermediate_size=intermediate,
                            act_fn=None if glu else module.act_fn, glu=glu, biases=biases)
        model.set_submodule(module_name, layer)
        report.replaced.append(module_name)
        placed.update(f"{module_name}.{n}" for n, _ in module.named_parameters())
        used += parts.values()
    return used


def _tie_lm_head(model: nn.Module, f, report: ReplaceReport, placed: set) -> None:
    """Without output.weight, llama.cpp multiplies by the token embedding's
    blocks; do the same for an LM head still tied to the embedding."""
    head = get_module(model, "lm_head")
    embd = f.tensors.get(TOKEN_EMBD)
    if "output.weight" in f.tensors or not isinstance(head, nn.Linear) or embd is None:
        return
    check_shape(f.path, embd, "lm_head", (head.out_features, head.in_features))
    model.set_submodule("lm_head", GGUFLinear.from_raw(embd.data, embd.type, head.in_features, head.bias))
    report.replaced.append("lm_head")
    placed.add("lm_head.weight")


def check_shape(path: str, t: GGUFTensor, target: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise GGUFError(f"{path}: tensor {shown(t.name)} has shape {tuple(t.shape)} but {target} needs {tuple(shape)}")
