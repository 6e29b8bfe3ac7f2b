"""DSpark: the release's block drafter (``mtp.*``), see docs/design/dspark.md."""
