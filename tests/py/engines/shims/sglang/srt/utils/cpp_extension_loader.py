"""Stand-in for sglang.srt.utils.cpp_extension_loader. SGLang's real native_hash.py (run as is)
loads mem_cache/cpp_utils/hash_binding.cpp through it, which needs torch's C++ toolchain; this
returns a pure-Python module with the same `get_hash`, ported from hash_binding.cpp: each page
is SHA-256 over (previous page's digest, if any) + the page's tokens as little-endian u32 (a
bigram page: each token followed by the next), or, when a token does not fit in 32 bits, 0xff +
the tokens as little-endian u64."""

import hashlib
import struct
from types import SimpleNamespace

_U32_MAX = 0xFFFFFFFF
_I64_MAX = (1 << 63) - 1


def _values(raw):
    """The buffer's items as the C++ code reads them (8-byte items as unsigned)."""
    if raw.itemsize == 8:
        return [v & 0xFFFFFFFFFFFFFFFF for v in raw]
    return list(raw)


def _wide(values, itemsize):
    if itemsize == 4:
        return False
    wide = False
    for v in values:
        if v > _I64_MAX:
            raise OverflowError("token id must be a non-negative int64")
        wide |= v > _U32_MAX
    return wide


def _words(page, units, is_bigram):
    if is_bigram:
        out = []
        for i in range(units):
            out += (page[i], page[i + 1])
        return out
    return page


def _hash_page(prior, words, wide):
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    if wide:
        h.update(b"\xff")
        h.update(struct.pack(f"<{len(words)}Q", *words))
    else:
        for w in words:
            if w > _U32_MAX:
                raise OverflowError("token id does not fit in uint32")
        h.update(struct.pack(f"<{len(words)}I", *words))
    return h.digest()


def _span(values, start, units, unit_width, is_bigram):
    if is_bigram:
        return values[start : start + units + 1] if units > 0 else []
    return values[start * unit_width : (start + units) * unit_width]


def get_hash(raw, logical_len, unit_width, is_bigram, prior_digest, page_size):
    if raw.itemsize not in (4, 8):
        raise ValueError("raw_tokens itemsize must be 4 or 8 bytes")
    if prior_digest is not None and len(prior_digest) != 32:
        raise ValueError("prior_digest must be exactly 32 bytes")
    if is_bigram:
        unit_width = 2
    values = _values(raw)
    prior = prior_digest
    if page_size is None:
        span = _span(values, 0, logical_len, unit_width, is_bigram)
        wide = _wide(span, raw.itemsize)
        return _hash_page(prior, _words(span, logical_len, is_bigram), wide).hex()
    if page_size == 0:
        raise ValueError("page_size must be positive")
    hashes = []
    for start in range(0, logical_len, page_size):
        units = min(page_size, logical_len - start)
        span = _span(values, start, units, unit_width, is_bigram)
        wide = _wide(span, raw.itemsize)
        prior = _hash_page(prior, _words(span, units, is_bigram), wide)
        hashes.append(prior.hex())
    return hashes


def load_extension_with_recovery(name, sources, **kwargs):
    if name != "hicache_hash_cpp":
        raise ImportError(f"no stand-in for the C++ extension {name!r}")
    return SimpleNamespace(get_hash=get_hash)
