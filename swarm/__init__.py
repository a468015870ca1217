"""shoal.swarm: the network: libp2p host, DHT, gossip, RPC, membership, broker and group collectives."""
