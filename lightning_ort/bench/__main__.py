"""``python -m lightning_ort.bench``: see :mod:`lightning_ort.bench.runner`."""

from lightning_ort.bench.runner import main

main()
