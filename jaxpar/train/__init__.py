"""Training: loss, optimizer, the jitted step, program setup and the loop."""
