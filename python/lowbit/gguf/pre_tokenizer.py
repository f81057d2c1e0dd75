"""How a byte-level (tokenizer.ggml.model "gpt2") vocabulary splits text
before its merges, as llama.cpp reads tokenizer.ggml.pre: transformers'
GGUF converter sets the split for the names it knows and GPT-2's for the
rest, which gives other token ids wherever a merge crosses the split that
the vocabulary was trained with (" 12" as one piece, not " ", "1", "2")."""
from __future__ import annotations

import warnings

from .._checks import shown

# llama.cpp names whose split is GPT-2's: transformers' fallback is theirs.
GPT2_SPLIT = frozenset({
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
    "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
    "granite-docling",
})
# llama.cpp names that isolate every digit (\p{N}) first, then split the rest as GPT-2.
DIGITS_THEN_GPT2_SPLIT = frozenset({
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2",
})


def _transformers_splits() -> frozenset[str]:
    """The names transformers' converter sets a split for (none where its
    module moved: every other name then warns, which is safe)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return frozenset()
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)


def split_as_llama_cpp(tokenizer, metadata: dict, where: str) -> None:
    """Gives `tokenizer` (built by transformers from the file) llama.cpp's
    split for the file's tokenizer.ggml.pre where transformers' differs, and
    warns where lowbit knows neither."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return
    pre = metadata.get("tokenizer.ggml.pre")
    said = "has no tokenizer.ggml.pre" if pre is None else f"tokenizer.ggml.pre {shown(pre)}"
    pre = pre if isinstance(pre, str) or pre is None else None  # a list would be unhashable, and names no split
    if pre in DIGITS_THEN_GPT2_SPLIT:
        from tokenizers import Regex, pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # GPT-2's split, then its bytes
        ])
    elif pre not in GPT2_SPLIT and pre not in _transformers_splits():
        warnings.warn(f"{where}: {said}: its text is split as GPT-2 splits it, which llama.cpp does not do for "
                      "this vocabulary, so some token ids may differ from llama.cpp's", stacklevel=3)
