"""The router tier: several router processes in front of one fleet (`--router-processes`)."""
