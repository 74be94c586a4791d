"""The network agents: the sender and the receiver (each a duty cycle over its channel
endpoints and their streams) and the thread that runs them; the simulator drives the same
agents with its own clock."""
