"""tileattn: exact FlashAttention in Triton, a drop-in superset of the flash_attn 2.x Python API.

Importing it registers the ``tileattn::`` custom ops; Triton loads only when a kernel first runs.
"""

from tileattn.api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from tileattn.checks import InvalidArgument, InvalidArgumentType
from tileattn.errors import check_errors
from tileattn.kvcache import flash_attn_with_kvcache
from tileattn.masks import flashmask_attention, flashmask_varlen_attention

__version__ = "0.1.0"

__all__ = [
    "InvalidArgument",
    "InvalidArgumentType",
    "__version__",
    "check_errors",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flashmask_attention",
    "flashmask_varlen_attention",
]
