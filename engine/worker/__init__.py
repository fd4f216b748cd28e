"""What every worker kind shares: the actor base, the contract with the router, the call
server, phases, warm-up."""
