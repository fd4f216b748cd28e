"""The fleet: Ray, the pools and their workers, the typed calls to them, the service's ports."""
