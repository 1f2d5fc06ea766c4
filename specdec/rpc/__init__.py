"""gRPC plumbing shared by the three services: error mapping, server assembly, channel options."""
