"""The copy bench, ``kvstage bench copy`` (`copy`): the seed PR's tables, with just what they
need. Every other benchmark and the fault-injection soak live outside the package, in the
repository's bench/ folder (``python -m bench.NAME``); nothing here imports them."""
