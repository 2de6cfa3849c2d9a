"""The decode kernels' settings that the variant scripts (decode_variants.py, decode_ab.py) change, by
short name, and a context manager that applies one variant's ``name=value,...`` changes."""

import contextlib

from tileattn.kernels import decode

SETTINGS = {
    "combine": "COMBINE_SPLITS_PER_LOAD",
    "crows": "COMBINE_MAX_ROWS",
    "cvals": "COMBINE_MAX_VALUES",
    "stages": "DECODE_STAGES",
    "waves": "DECODE_WAVES",
    "mintiles": "DECODE_MIN_SPLIT_TILES",
    "interleave": "DECODE_INTERLEAVE",
    "unit": "DECODE_INTERLEAVE_UNIT",
    "plong": "PAGED_LONG_STAGES",
    "ptiles": "PAGED_LONG_TILES",
    "tma": "DECODE_TMA",
    "ptma": "PAGED_TMA",
    "ptstages": "PAGED_TMA_STAGES",
    "tmatiles": "DECODE_TMA_TILES",
    "pdl": "DECODE_PDL",
    "pdlattn": "DECODE_PDL_ATTN",
    "pwarps": "PAGED_WARPS",
    "pprefetch": "PAGED_PREFETCH_WAVES",
    "offs64": "OFFS_64_ALWAYS",
    "fstages": "FULL_GRID_STAGES",
    "ftiles": "FULL_GRID_TILES",
    "tl2": "PAGED_TABLE_L2",
    "sbn": "SHORT_BLOCK_N",
    "stiles": "SHORT_TILES",
    "spt": "SHORT_SMALL_PAGE_TILES",
}
SM_COUNT = "sms"  # the SM count the split heuristic plans for (decode._sm_count), e.g. sms=120


@contextlib.contextmanager
def apply(variant: str):
    saved = {attr: getattr(decode, attr) for attr in SETTINGS.values() if hasattr(decode, attr)}  # (older trees)
    saved["_sm_count"] = decode._sm_count
    try:
        for change in filter(None, variant.split(",")):
            name, _, value = change.partition("=")
            if name == SM_COUNT:
                decode._sm_count = lambda device, sms=int(value): sms
            else:
                setattr(decode, SETTINGS[name], int(value))
        yield
    finally:
        for attr, value in saved.items():
            setattr(decode, attr, value)
