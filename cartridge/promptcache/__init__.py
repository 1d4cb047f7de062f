"""mlx-lm's prompt-cache files both ways: import one as a cartridge (`importer`), export a cartridge as one (`exporter`)."""
