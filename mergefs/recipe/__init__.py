"""The output model as output tensors, each with its sources and resolved parameters."""
