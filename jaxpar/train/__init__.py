"""Training: loss, the jitted step, program setup and the loop (optimizers and schedules: `jaxpar.optim`)."""
