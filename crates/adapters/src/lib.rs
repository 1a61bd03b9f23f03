//! bgs-adapters
