"""The `cartridge` command line (click): parse, call the library, print."""
