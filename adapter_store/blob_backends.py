"""Which blob store a store URL names: file:// (local files) or s3:// (aiobotocore)."""

import logging

from adapter_store.blobs import BlobStore
from adapter_store.config import StoreConfig
from adapter_store.file_blobs import FileBlobStore
from adapter_store.s3_blobs import S3BlobStore

log = logging.getLogger(__name__)


async def open_blob_store(config: StoreConfig) -> BlobStore:
    """The blob store `config.url` names."""
    if config.is_s3:
        store: BlobStore = await S3BlobStore.open(config)
    else:
        config.file_root.mkdir(parents=True, exist_ok=True)
        store = FileBlobStore(config.file_root, config.max_adapter_bytes)
    log.info("blob store: %s", store.description)
    return store
