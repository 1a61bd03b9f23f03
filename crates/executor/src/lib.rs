//! bgs-executor
