"""The `Pipeline` facade's collaborators (pipeline.api delegates to them): the settings checks,
planning and setup from the first batch, running a step, the model's state, and measurement."""
