"""Reading a cartridge: verify and map it (`load`), the loaded cartridge (`loaded`), its stored layers (`stored`)."""
