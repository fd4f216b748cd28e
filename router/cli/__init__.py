"""`pdserve`'s command line: flags, their checks, the commands, and the clients it drives."""
