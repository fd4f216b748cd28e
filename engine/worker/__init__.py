"""What both worker kinds share: the actor base, the call server, phases, warm-up."""
