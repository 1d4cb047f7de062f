"""Growing a cartridge past its stored pages by more document text (`extend`)."""
