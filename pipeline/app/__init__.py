"""The application: the hybridpipe command line and the demo with its model and data."""
