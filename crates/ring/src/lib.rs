//! bgs-ring
