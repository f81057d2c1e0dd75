"""Shape arithmetic of GPTQ packing (the packing itself is C++): b-bit fields
fill int32 words in packs of 32 fields in 3 words (3-bit) or 32/b fields in
one word (2/4/8-bit)."""


def fields_per_pack(bits: int) -> int:
    return 32 if bits == 3 else 32 // bits


def words_per_pack(bits: int) -> int:
    return 3 if bits == 3 else 1
