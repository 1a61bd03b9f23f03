//! bgs-transport
