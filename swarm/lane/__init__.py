"""A pipeline lane's data plane: the links between neighbouring stages (hub, end, spec) and AQ-SGD over them."""
