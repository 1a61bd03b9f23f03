//! bgs-cpuacct
