"""DeepSeek-V4.1's vision side: the resize plan, image decoding, the ViT, the aligner, the span."""
