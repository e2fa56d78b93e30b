"""deepinfer-launch: the command line, topology, supervisor, systemd units."""
