"""The persistent SSD tier: page files, the start-up scan, bounded reads, write health."""
