"""Rules of which rows run which layers, shared by every runner."""
