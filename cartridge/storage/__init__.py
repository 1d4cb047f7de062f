"""The layers as stored: each kind planned, written and loaded back (`kinds`, `store`); one rank's bytes (`shard`)."""
