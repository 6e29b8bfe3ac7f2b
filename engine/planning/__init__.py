"""Figures on paper before anything loads: parameter and KV bytes, the memory plan, EP traffic."""
