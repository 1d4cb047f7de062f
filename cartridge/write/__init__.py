"""Writing a cartridge: prefill and write (`build`), re-encode (`convert`), write one grown by a tail (`append`)."""
