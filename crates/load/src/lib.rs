//! bgs-load
