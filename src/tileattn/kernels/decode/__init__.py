"""Attention against a KV cache (decoding, chunked and paged prefill; forward only), one concern a file:
``paging`` (where a key tile lies in a contiguous or paged cache), ``split`` (the split-KV attention
kernel), ``combine`` (the merge of its splits), ``rotary`` (the rotation q and the new keys share),
``append`` (the in-place append of new keys and values) and ``plan`` (tiles, splits and launch
options from the call and ``params.DecodeSettings``; plans kept per call signature). The ops layer
calls ``attn_fwd_kvcache`` and ``kvcache_append``.
"""

from tileattn.kernels.decode.append import kvcache_append
from tileattn.kernels.decode.plan import attn_fwd_kvcache

__all__ = ["attn_fwd_kvcache", "kvcache_append"]
