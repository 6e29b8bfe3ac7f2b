"""The device tier: page layout and bytes, page hashes, refcounted block pool."""
