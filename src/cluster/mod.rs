//! The cluster: membership (SWIM gossip through foca, on its own thread) and what members
//! tell each other about themselves.
