"""The network underneath everything: libp2p host, identity, framing, RPC, gossip, membership, penalties."""
