"""The Hugging Face Hub (or a mirror, `HF_ENDPOINT`) and its local cache: which files to fetch,
fetching them verified and resumable into the standard cache, and what the store's models use there.

    spec.py          `owner/name[:QUANT]`, picking the GGUF of a quant, checks of names from the server
    cache.py         the HF cache, snapshots of a repo at one commit, placing blobs and links safely
    download.py      the download engine: Range resume across runs, hashing while receiving, retries
    housekeeping.py  disk use and purging of the cache files models came from

Pulling a model into the store (and converting/quantizing a safetensors repo) is `edgeinfer.pull`,
on top of this package; nothing here imports the converter or the quantizer.
"""

from __future__ import annotations

from .cache import HubFile, cache_dir
from .download import DownloadProgress
from .housekeeping import DiskUsage, DiskUsageRow, disk_usage, purge_cache, source_label
from .spec import DEFAULT_QUANT, SOURCE_FILES, parse_spec, select_gguf

__all__ = [
    "HubFile",
    "DownloadProgress",
    "DiskUsage",
    "DiskUsageRow",
    "parse_spec",
    "select_gguf",
    "purge_cache",
    "disk_usage",
    "cache_dir",
    "source_label",
    "SOURCE_FILES",
    "DEFAULT_QUANT",
]
